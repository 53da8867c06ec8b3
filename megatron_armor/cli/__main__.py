import sys

from megatron_armor.cli import main

sys.exit(main())
