"""After the gradients: their buffers and accumulation, mixed precision's loss scaling, data parallel
(all-reduce, ZeRO-1), the per-step record, and the trainer's state and HDF5 checkpoints. (The optimizer
updates are in ``orttrainer/optim``.)"""
