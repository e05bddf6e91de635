# Shortcuts for the scripts the README documents.
.PHONY: chat test install setup
install:
	bash scripts/install.sh
setup: install
	python3 main.py setup
chat:
	bash scripts/chat.sh
test:
	bash scripts/test.sh
