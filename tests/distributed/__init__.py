"""Distributed tests: real gloo process groups of 2 CPU ranks, each run under a timeout."""
