"""`python -m mas_trainer ...`: the `mas-trainer` command, for an interpreter whose scripts are not on PATH."""

from mas_trainer.cli import main

raise SystemExit(main())
