"""The commands around training: ``study`` (a matrix of runs, :mod:`.study`), ``probe`` (a verdict on one
recipe, :mod:`.probe`) and ``plan`` (the pipeline planning map: the command :mod:`.plan`, its rows
:mod:`.plan_table`)."""
