"""`python -m pipeline.eval --output-dir RUN_DIR [the run's flags]`: evaluate a run's saved weights
(see launch/eval_run.py).

Like `pipeline.launch`, a shim: the import of `launch` runs only under `if __name__ == "__main__"`,
so importing pipeline never imports launch (launch -> pipeline -> stages -> storage).
"""

if __name__ == "__main__":
    import sys

    from launch.eval_run import main

    sys.exit(main())
