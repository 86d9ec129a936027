"""Tools for what a run made: ``predict`` (classify images), ``export`` (ONNX), ``copy_recipe`` (start
your own recipe). Each runs as ``python -m common.tools.<name> --help``."""
