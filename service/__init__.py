"""The gRPC server around the engine.

Importing the package sets the OpenMP defaults the server runs with (`service.openmp`), before any of its
modules imports torch.
"""

from service.openmp import apply_openmp_defaults

apply_openmp_defaults()
