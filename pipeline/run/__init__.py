"""One run of the launcher, from the command line to its last line: the CLI and the run loop
(`cli`), the engines it uses (`engines`), what it records beside the store (`records`), the parts
its flags switch on (`parts`), the run folder (`folder`), building what a run needs from its
config (`state`), resume checks (`resume_settings`), how a run ends (`end`), another node of a
multi-node run (`node`) and the standalone evaluation (`eval_run`)."""
