from minifsdp.tools.cli import main

raise SystemExit(main())
