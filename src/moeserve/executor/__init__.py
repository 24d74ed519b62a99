"""Parallel layouts: tensor (TP), pipeline (PP) and expert (EP) parallelism."""
