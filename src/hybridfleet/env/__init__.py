"""Environment: check this machine, lock its fingerprint, diff two locks, render images.

Modules: `host` (OS, CPU, memory, GPU driver facts), `probe` (framework facts,
read in a child process), `smoke` (the 2-process all-reduce test), `check`,
`lock`, `diff`, `images` (the published base-image table), `dockerfile`,
`docker` (the engine). Importing this package imports neither torch nor paddle.
"""
