"""`python -m pipeline.launch --help`: run the rollout pipeline (see launch/cli.py).

The one place `pipeline` reaches into `launch`: the entry point the README promises, kept as a shim
so the import direction (launch -> pipeline -> stages -> storage) holds everywhere else.
"""

if __name__ == "__main__":
    import sys

    from launch.cli import main

    sys.exit(main())
