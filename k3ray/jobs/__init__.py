"""What every running job keeps, training's and serving's alike, below both: its incident log (`incidents`) and its
live policies, their queued changes and audit (`live_policies`). Plain Python over the configs: no Ray, no torch."""
