from kvhandoff.actors.cli import main

raise SystemExit(main())
