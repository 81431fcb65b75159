from minifsdp.commands.cli import main

raise SystemExit(main())
