"""One run of the launcher, from the command line to its last line: the CLI (`cli`), the run
folder (`folder`), building what a run needs from its config (`state`), resume checks
(`resume_settings`), how a run ends (`end`) and the standalone evaluation (`eval_run`)."""
