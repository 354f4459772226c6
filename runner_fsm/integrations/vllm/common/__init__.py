"""What every part of the vLLM integration shares: its errors, the vLLM names it relies on
(checked at start-up), and its fault injections."""
