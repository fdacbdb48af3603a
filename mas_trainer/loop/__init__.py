"""The training loop (`trainer.py`), the rollouts it runs (`session.py`: gateway and engines;
`controller.py`: the app on each task), counterfactual forks (`forking.py`), evaluation
(`evaluate.py`) and the engine answering each policy in every verb (`backends.py`)."""
