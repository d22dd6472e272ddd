"""The side concerns of the shared loop (trainers/loop.py), each a `LoopCallback` with named hooks (base.py): the
hang watcher's marks, the step bar, the profiler, the start-up metrics, the straggler check, FLOPs and MFU, the
divergence file, and the testing hooks that inject faults. A run's worker gets the ones it wants
(trainers/worker.py `ray_callbacks`); the loop knows none of them."""
