"""The compile driver: load a model (frontend), optimise its graphs (passes), lower them to kernels
(codegen) and write the artifact (runtime's format); also `verify`, `check-numerics`, tuning and the
compile cache. The only stage that imports the others."""
