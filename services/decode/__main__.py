"""`python -m services.decode [worker flags]`: a worker in the decode role (see services/worker)."""
import sys

from services.worker.__main__ import main

if __name__ == "__main__":
    main(["--role", "decode", *sys.argv[1:]])
