"""The report's pieces: figures (figures.py), the plots of the model and the choice (plots.py), the training section
(training_section.py) and the search's account (search_section.py).

May import the folders before it (core, cluster, memory, training, profiling, performance); it needs core only.
"""
