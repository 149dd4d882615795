from mrl.quickstarts.cli import main

raise SystemExit(main())
