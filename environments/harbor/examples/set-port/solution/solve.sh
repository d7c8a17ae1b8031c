#!/bin/bash
sed -i 's/^port = 80$/port = 8080/' /app/settings.ini
