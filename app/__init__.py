"""llm-forge's Gradio app: configure runs from the recipe schema, launch and watch them, chat with results.

python -m app [--host 127.0.0.1] [--port 7860] [--workspace DIR] [--auth user:pass]
"""
