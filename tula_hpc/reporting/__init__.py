"""The report's pieces: its sections (choice_section.py, outcome_section.py, memory_section.py, model_section.py with
the search's account in search_section.py, training_section.py), the plots of the model and the choice (plots.py) and
figures (figures.py: matplotlib without a display, links, markdown tables), in the words of the task trained
(task_words.py, from eval.json). The report stage reads, assembles, writes.

May import the folders before it (core, cluster, memory, training, profiling, performance); it needs core and cluster.
"""
