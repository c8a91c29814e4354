"""The tier study: which CPU-tier setup wins, where, against which bound, on the simulator.

``study`` holds what the studies share (the setups, the workloads and their train/test parts);
``setups`` runs the ablation and the re-store map; the others each answer one question of the
paper (``capacity``, ``tune_shares``, ``conversational_gap``, ``lfu_recency``, ``hole_rewind``,
``integrity``, ``default_setup``)."""
