from cs336_systems.report.build import main

raise SystemExit(main())
