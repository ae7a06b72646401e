"""`python -m services.prefill [worker flags]`: a worker in the prefill role (see services/worker)."""
import sys

from services.worker.__main__ import main

if __name__ == "__main__":
    main(["--role", "prefill", *sys.argv[1:]])
