"""`fanstore demo`: the built-in training set (demo_data) and the demo run (demo; demo_torch and demo_training for
its PyTorch part). The package imports none of its modules."""
