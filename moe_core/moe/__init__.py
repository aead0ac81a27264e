"""Mixture-of-experts layer: router.py (TopKRouter), token_dispatcher*.py (dispatch/combine), experts.py
(GroupedMLP, SequentialMLP), shared_experts.py, moe_layer.py (MoELayer); data flow in docs/design.md."""
