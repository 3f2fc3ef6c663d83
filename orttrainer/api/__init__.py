"""What the user hands the trainer, checked and described: the options tree, model_desc and the batch's
matching to graph inputs, what the model returns, the constructor's argument checks. (The public names are
in ``orttrainer/__init__.py``.)"""
