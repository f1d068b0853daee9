from torch.cuda.amp import autocast, GradScaler

scaler = GradScaler()

for batch in loader:
    optimizer.zero_grad()
    
    with autocast():  # 自动混合精度
        output = model(batch["input"])
        loss = criterion(output, batch["target"])
    
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
# ruff: noqa  (verbatim from the seed document, kept as written: it is a lint fixture)
