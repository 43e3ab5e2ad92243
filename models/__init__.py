"""The bundled model files: installed as the data package fasop.models (setup.cfg) so that fasop.inputs.bundled
finds them by name wherever fasop is installed."""
