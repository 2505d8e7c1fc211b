import sys

from soak.harness import main

sys.exit(main())
