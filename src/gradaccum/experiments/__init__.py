"""Embedded experiments for the `gradaccum` command line: tasks, the training runner, reports.

Nothing here is needed to use the library; it is what `gradaccum train|compare|demo` run.
"""
