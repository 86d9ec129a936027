"""Tools for what a run made: ``predict`` (classify images), ``export`` (ONNX), ``copy_recipe`` (start your own
recipe), each run as ``python -m common.tools.<name> --help``; and ``launching`` and ``machine``, which the tests and
benchmarks use to run recipes as users do and to say what a measurement ran on."""
