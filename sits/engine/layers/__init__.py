"""The model's building blocks, each with the reference PyTorch code and, where one measures faster
on the device at hand, a path chosen once when the model is prepared (``prepare_model``)."""
