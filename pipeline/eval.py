"""`python -m pipeline.eval --output-dir RUN_DIR [the run's flags]`: evaluate a run's saved weights
(`pipeline/run/eval_run.py`)."""

if __name__ == "__main__":
    import sys

    from pipeline.run.eval_run import main

    sys.exit(main())
