import sys

from gspo_study.cli import main

sys.exit(main())
