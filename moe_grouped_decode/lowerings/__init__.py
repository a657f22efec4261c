"""Inductor pattern passes: rewrite dense MoE calls into the grouped decode op."""
