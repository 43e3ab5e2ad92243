"""The bundled layer profiles, <model>/<gpu>.csv: installed as the data package fasop.profiles (setup.cfg) so
that fasop.inputs.bundled finds them by name wherever fasop is installed."""
