"""What crosses between ffctl's processes, and nothing else: the typed control messages
(`messages`), the sealed store protocol they travel by (`control`), a generation's restore plan
(`generation_plan`) and the environment a rank is started with (`jobenv`).

The controller, the agents and the ranks all speak it, so it sits below all of them: it imports
only the run record's vocabulary (`runs`), and torch's store client where it talks to the store.
"""
