"""What the agent tells about itself and never acts on: the observer that receives the agent's
moments, the story lines, events.jsonl, metrics and the health port.
"""
