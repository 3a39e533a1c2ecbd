from cs336_systems.analysis.cli import main

raise SystemExit(main())
