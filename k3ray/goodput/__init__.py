"""Goodput planning: what fraction of GPU time becomes training when a K3-class job runs for weeks on thousands of
GPUs under a failure process, and which snapshot interval, checkpoint interval and spare count maximise it.

Pure Python + numpy, seeded, no Ray. Modules, in the order a plan uses them:
    profiles     failure classes and their rates (Llama 3's published table, a constant MTBF, node losses, files)
    calibration  the measured phase figures (defaults from benchmarks/RESULTS.md; a file written from incidents.jsonl)
    costs        the grid a GPU count gives and each phase's seconds, from the calibration scaled to the model
    simulate     the discrete-event simulation: one seeded run of `days` under a profile and a policy
    optimise     the grid search over snapshot_every, checkpoint every_n_steps and spares; Young/Daly as a check
    report       the table, the formulas, JSON and an SVG plot of goodput against GPUs

Notation: G GPUs in the training grid (pp stages x C data-parallel columns), S hot spares (GPUs beside the grid),
T wall seconds simulated, t_step one step of the full grid, E_s snapshot_every, E_c checkpoint every_n_steps.
Goodput = (steps kept x t_step x G) / (T x (G + S)): GPU time of the grid and its spares that became training.
"""
