from minifsdp.cli import main

raise SystemExit(main())
