from cs336_systems.bench.cli import main

raise SystemExit(main())
