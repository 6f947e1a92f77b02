import sys

from batonlm.cli import main

if __name__ == "__main__":  # spawned processes re-import this module as __mp_main__
    sys.exit(main())
