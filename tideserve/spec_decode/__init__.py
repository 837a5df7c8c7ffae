"""Speculative decoding: proposals for a request's next tokens, verified by one forward pass of the model.

``ngram.py`` proposes (prompt lookup in the request's own text), or a draft model does (its checks in
``draft.py``, its passes on the worker in ``worker/draft_proposer.py``); ``proposals.py`` decides which running
requests get proposals each step (the acceptance policy); the scheduler schedules a request's last token plus
its proposals, the runner verifies them (``verify.py``: the target model's own token at every position, a
proposal accepted while it equals that token), and the scheduler keeps the accepted tokens and hands the
rejected positions' KV slots back.
"""
