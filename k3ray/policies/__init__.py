"""Policies: pure functions over load tensors that return plans or decisions (no Ray, no actors).

Notation (the project's legend; every docstring in k3ray uses it):
    E         routed experts per MoE layer (logical experts)
    R         expert-parallel (EP) ranks
    K         top-k experts per token
    s         tokens per rank (per micro-batch); a rank sends s*K token slots per layer
    d         model width (d_model);  d_latent  routed-expert width (d/2 in K3);  I  expert inner width
    L         MoE layers
    P         physical experts (expert weight copies placed on ranks; P >= E with persistent replicas)
    G         expert GEMMs queued on one GPU
    home[e]   the rank that owns expert e's weights and optimizer state

Modules:
    moonep       per-micro-batch balance: alloc[E, R] from tokens_per_expert[R, E], exact or priced
    expert_cost  modelled seconds of a layer's expert work: busiest rank's rows + weight copies (NVLink, InfiniBand)
    replication  persistent replicas from a load history (DeepSeek EPLB vocabulary)
    scheduling   the order in which a GPU runs its local expert GEMMs
    ladder       a blow-up: roll back and skip batches, lower the learning rate, or stop (TripDecision)
    recovery     workers lost: hot spares, shrink or restart, experts re-homed (LossDecision)
    resize       a resize asked for or a grow-back due at a step boundary (ResizeDecision)
    retry        the doubling, capped backoff between a bounded handler's attempts
    snapshot_cadence  steps between in-memory snapshots from what they cost (snapshot_every: auto)
"""
