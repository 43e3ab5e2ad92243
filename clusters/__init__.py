"""The bundled cluster files and, in catalogue/, the GPU spec and cloud instance tables: installed as the data
package fasop.clusters (setup.cfg) so that fasop.inputs.bundled finds them by name wherever fasop is installed."""
