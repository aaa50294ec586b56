"""The recipes shipped with lightning-async, installed as the data package ``lightning_async.recipes``
(see ``package_dir`` in setup.cfg). Use them by name: ``lightning-async fit --config quickstart``;
``lightning-async recipes`` lists them (:mod:`lightning_async.recipes_index`)."""
