"""`python -m pipeline.launch --help`: run the rollout pipeline (the CLI is `pipeline/run/cli.py`)."""

if __name__ == "__main__":
    import sys

    from pipeline.run.cli import main

    sys.exit(main())
