"""Tools for what a run made: ``predict`` (classify images) and ``export`` (ONNX), each run as
``python -m common.tools.<name> --help``; ``recipe_files`` imports a recipe file as a module for them."""
