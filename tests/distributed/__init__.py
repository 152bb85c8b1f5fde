"""Tests of fedcomp.distributed: multi-process gloo runs on 127.0.0.1."""
